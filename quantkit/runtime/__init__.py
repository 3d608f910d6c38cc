"""The bundled serving runtime: paged KV cache, continuous batching scheduler, model runner, engine, LLM."""
