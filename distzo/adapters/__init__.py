"""Trainable adapters on a frozen base, through ``peft``: LoRA, LoRA-FA and prefix tuning."""
