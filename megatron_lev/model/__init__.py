"""Model code: the LEV layer and baseline input embeddings, Llama-style blocks, the GPT model, its stages."""
