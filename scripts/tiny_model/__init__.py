"""Parts of scripts/train_tiny_model.py: the fortune corpus, the tokenizer and chat format, the model card."""
