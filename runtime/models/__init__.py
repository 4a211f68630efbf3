"""Model families: LlamaGen GPT, VQ tokenizer, EAGLE/LANTERN drafter, T5 wrapper, loading."""
