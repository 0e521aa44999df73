"""Writes input_fns/digits.npz, the embedded data set, from scikit-learn.

Run once, by a maintainer with scikit-learn installed:

    python -m input_fns.make_digits

The trainer then reads the 1,797 digits from the package file, so neither
scikit-learn nor SciPy is needed to train on them. The file holds the 8x8
images' pixels (ints in [0, 16], as load_digits gives them) as uint8 and
their labels, in load_digits' order (example ids are indices in it).
"""

import os

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'digits.npz')


def main() -> None:
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  bunch = datasets.load_digits()
  pixels = bunch.data.astype(np.uint8)
  # uint8 holds load_digits' integer pixels exactly.
  assert np.array_equal(pixels, bunch.data)
  np.savez_compressed(PATH, pixels=pixels,
                      labels=bunch.target.astype(np.uint8))
  print(f'wrote {PATH}: {len(pixels)} digits, {os.path.getsize(PATH)} bytes')


if __name__ == '__main__':
  main()
