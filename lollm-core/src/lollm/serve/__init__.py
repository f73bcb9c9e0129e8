"""Layer 4 of core: serving. ``lollm serve``'s HTTP server (OpenAI-compatible), its metrics and
its tool calls, on top of the engine's one driver.
"""
