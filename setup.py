"""Packaging shim: the metadata lives in setup.cfg.

`gcloud ai-platform jobs submit training --package-path trainer` builds the
package with `python setup.py sdist` when this file is beside `trainer/`;
without it gcloud generates a setup.py that packs `trainer/` alone, and the
job fails with "No module named 'input_fns'". `python -m build` reads
pyproject.toml and setup.cfg, and ends in the same package.
"""

import setuptools

setuptools.setup()
