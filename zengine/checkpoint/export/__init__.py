"""Files for other tools from a checkpoint: fp32 state_dict, safetensors, the 16-bit model."""
