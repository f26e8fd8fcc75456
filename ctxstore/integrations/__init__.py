"""Optional bridges between ctxstore and inference libraries.

Each submodule needs its library installed and is imported on its own; importing ``ctxstore`` never loads
them. ``ctxstore.integrations.transformers``: Hugging Face causal LMs (the ``transformers`` extra).
``ctxstore.integrations.vllm``: a vLLM KV connector (the ``vllm`` extra).
``ctxstore.integrations.lmcache``: an LMCache remote-storage plugin on the bulk API (LMCache 0.5.6).
"""
