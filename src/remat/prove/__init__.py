"""Showing the proof: the bench harness, its reports and plots, and a CPU peak-memory meter."""
