"""Glue to the libraries users train with (Hugging Face configs and models, PEFT, trainers)."""
