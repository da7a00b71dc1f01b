"""Export stage: checkpoints for the engines that serve (vLLM: compressed-tensors; llama.cpp: GGUF)."""
