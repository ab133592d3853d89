"""Multi-LoRA serving: PEFT adapters on a Llama-family base model, applied per request (as SGLang does)."""
