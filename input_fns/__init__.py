"""tf.data input_fns that keep the towers fed.

Each constructor returns a `Data`: its kind ('tabular' or 'image'),
n_classes, feature_columns and image_shape, and the train, eval and predict
input_fns, example_ids and serving receivers the trainer needs.

    data = input_fns.digits()              # embedded; no download
    estimator.train(data.train_input_fn(batch_size=128), steps=1000)
"""

from input_fns.csv import csv_data
from input_fns.csv import CsvData
from input_fns.data import Data
from input_fns.digits import digits
from input_fns.image_folder import image_folder_data
from input_fns.image_folder import ImageFolderData
from input_fns.synthetic import arrays_input_fn
from input_fns.synthetic import gaussian_blobs
from input_fns.synthetic import synthetic_images
from input_fns.synthetic import synthetic_tabular
from input_fns.tfrecord import tfrecord_data
from input_fns.tfrecord import TFRecordData

__all__ = [
    'CsvData', 'Data', 'ImageFolderData', 'TFRecordData', 'arrays_input_fn',
    'csv_data', 'digits', 'gaussian_blobs', 'image_folder_data',
    'synthetic_images', 'synthetic_tabular', 'tfrecord_data',
]
