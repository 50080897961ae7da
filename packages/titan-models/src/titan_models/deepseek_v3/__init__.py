"""DeepSeek-V3: args and flavors, the model, and the Hugging Face adapter."""
