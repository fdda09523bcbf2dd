"""prime-plugin-lora: LoRA adapters for the trainer."""
