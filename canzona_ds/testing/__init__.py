"""In-repo stand-ins for code that cannot run here (Megatron-DeepSpeed needs CUDA)."""
