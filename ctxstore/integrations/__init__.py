"""Optional bridges between ctxstore and inference libraries.

Each submodule needs its library installed and is imported on its own; importing ``ctxstore`` never loads
them. ``ctxstore.integrations.transformers``: Hugging Face causal LMs (``pip install 'ctxstore[transformers]'``).
``ctxstore.integrations.vllm``: a vLLM KV connector (``pip install 'ctxstore[vllm]'``).
``ctxstore.integrations.lmcache``: an LMCache remote-storage plugin on the bulk API (LMCache 0.5.6).
"""
