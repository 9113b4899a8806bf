"""The model behind examples/finetune_llama.py: config.json reading (config), the NNX
model (model) and Hugging Face's tensor names and files (hf_files)."""
