"""Merging specs: phase 5 of the tower build (see replicate.py).

The towers' EstimatorSpecs as one (spec_merge), EVAL's adds once per step
(metric_adds), TPUEstimatorSpecs (tpu_spec), and a SavedModel over towers
for prediction (saved_model_towers).
"""
