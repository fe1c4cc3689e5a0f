"""thoughtjax: a pretrained LLM cut into thoughtlets, composed into one XLA program."""
