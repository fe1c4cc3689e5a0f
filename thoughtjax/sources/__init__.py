"""Model sources: GGUF files and Hugging Face safetensors directories."""
