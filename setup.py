"""Shim for tools that still call setup.py; all metadata lives in setup.cfg.

The one thing setup.cfg cannot say: the optional C helper of the compact store. ``optional=True`` makes a
failed build a warning, and the package then runs on its pure-Python path (see ``lightning_ddp_ext/_store.py``).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("lightning_ddp_ext._compact", ["lightning_ddp_ext/_compact.c"], optional=True)])
