"""From raw text to training samples: tokenizers, MMIDIDX shards, GPT sample indices, samplers.

Data code never imports model code. The shard format is Megatron's indexed dataset
byte for byte (spec: PLATFORM.md, "Data format"), so shards move freely between
this project, Megatron-LM and GPT-NeoX.
"""
