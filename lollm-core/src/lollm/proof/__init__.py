"""Proving and measuring: the parity gate against transformers and the benchmarks beside
transformers and llama.cpp. Above the engine, below the commands.
"""
