"""A client of a vLLM (OpenAI-compatible) server with the local engine's interface (`EngineClient`)."""
