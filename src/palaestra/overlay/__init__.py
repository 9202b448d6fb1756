"""A recipe's ``image_overlay``, honoured where the run runs: ``image`` records the calls it
makes on its stand-in image, ``environment`` builds (once) and caches the environment those
calls describe, and says how a process runs in it."""

from palaestra.overlay.image import Image, ImageOverlayError, overlay_steps

__all__ = ["Image", "ImageOverlayError", "overlay_steps"]
