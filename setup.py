"""Shim for tools that still call setup.py; all metadata lives in setup.cfg.

The one thing setup.cfg cannot say: the optional C helper of the compact store. ``optional=True`` makes a
failed build a warning, and the package then runs on its pure-Python path (see ``lightning_ddp_ext/_store.py``).
The build records a digest of the C source in the module, so that a helper built from older sources (an
editable checkout pulled without rebuilding) is noticed and set aside rather than called with new arguments.
"""
import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "lightning_ddp_ext/_compact.c"
# The same digest as lightning_ddp_ext._store.source_digest (setup.py cannot import the package to share it).
DIGEST = hashlib.sha256(Path(__file__).parent.joinpath(SOURCE).read_bytes().replace(b"\r\n", b"\n")).hexdigest()

setup(
    ext_modules=[
        Extension(
            "lightning_ddp_ext._compact", [SOURCE], define_macros=[("SOURCE_DIGEST", f'"{DIGEST}"')], optional=True
        )
    ]
)
