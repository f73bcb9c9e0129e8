"""Images in: plugin contract 3 (vision). Read docs/vision.md first.

    image.py       bytes / a file / a data: URL -> one checked RGB PIL image (every hostile case refused)
    preprocess.py  the shared math: resize, rescale, normalize, patchify, and a hash of the pixels
    spec.py        what a family fills in: VisionSpec, the VisionTower protocol; what its decoder
                   receives: ImageBatch of PlacedImage
    prompt.py      encode the images, expand the placeholders, place the images, scatter them

``lollm.vision.image`` needs only Pillow; the other modules need torch.
"""

from lollm.vision.image import MAX_PIXELS, MAX_SIDE, decode_data_url, decode_image, read_image_file
from lollm.vision.spec import ImageBatch, PlacedImage, VisionSpec, VisionTower

__all__ = ["MAX_PIXELS", "MAX_SIDE", "ImageBatch", "PlacedImage", "VisionSpec", "VisionTower", "decode_data_url",
           "decode_image", "read_image_file"]
