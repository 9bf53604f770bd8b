"""Glue to what users train with: the Hugging Face Trainer and TRL, Lightning, accelerate, and the garbage collector between steps."""
