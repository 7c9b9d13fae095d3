"""Model code: Llama-family transformers on a paged KV cache (imports torch)."""
