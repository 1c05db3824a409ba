"""megatron-lev: Megatron/GPT-NeoX-style pretraining with the Leviathan (LEV) input layer."""

__version__ = "0.1.0"
