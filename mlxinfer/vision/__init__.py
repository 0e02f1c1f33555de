"""Images in: hostile files and arrays read into RGB pixels (images.py), and a model's image processor (preprocess.py).

Nothing here knows a model: the vision towers that turn `pixel_values` into prompt embeddings live with the model
code (models/vision.py, models/siglip.py, families/), and the engine places them in the prompt.
"""

from .images import (
    DEFAULT_LIMITS,
    FORMATS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    Limits,
    Opened,
    base64_bytes,
    check_count,
    data_url_bytes,
    file_data_url,
    open_images,
    read_image,
    read_images,
)
from .preprocess import (
    PREPROCESSOR_FILE,
    BudgetProcessor,
    ImageProcessor,
    Layout,
    PatchProcessor,
    PixelRangeProcessor,
    Processor,
    SplitProcessor,
    TileProcessor,
    digest,
    processor_from_folder,
)

__all__ = [
    "DEFAULT_LIMITS",
    "FORMATS",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGES",
    "PREPROCESSOR_FILE",
    "BudgetProcessor",
    "ImageProcessor",
    "Layout",
    "PatchProcessor",
    "PixelRangeProcessor",
    "Processor",
    "SplitProcessor",
    "TileProcessor",
    "Limits",
    "Opened",
    "base64_bytes",
    "check_count",
    "data_url_bytes",
    "digest",
    "file_data_url",
    "open_images",
    "processor_from_folder",
    "read_image",
    "read_images",
]
