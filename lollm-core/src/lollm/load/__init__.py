"""Loading, the layer of core above the model seams and below generation: a spec becomes a model.

The loader reads a folder, a repo id or a GGUF file; the plugins route its type to a family; the
pipeline builds the model with one LoadOptions (device, dtype, attention backend, packed weights,
tensor parallel). docs/architecture.md draws the layers.
"""
