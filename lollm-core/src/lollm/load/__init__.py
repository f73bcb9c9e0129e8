"""Layer 1 of core: files and plumbing. A spec becomes a model: the loader reads a folder, a repo id
or a GGUF file; the plugins route its type to a family; the pipeline builds the model with one
LoadOptions (device, dtype, attention backend, packed weights, tensor parallel).
"""
