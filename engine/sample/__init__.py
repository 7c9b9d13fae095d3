"""Token sampling from logits (imports torch)."""
