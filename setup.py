from setuptools import setup

setup(cffi_modules=["cffi_build/build_bridge.py:ffibuilder"])
