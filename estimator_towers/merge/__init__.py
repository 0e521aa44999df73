"""Merging specs: phase 5 of the tower build (see replicate.py).

The towers' EstimatorSpecs as one (spec_merge), EVAL's adds once per step
(metric_adds), TPUEstimatorSpecs (tpu_spec), and SavedModels over towers:
batch prediction and SavedModelEstimator's towers (saved_model_towers).
"""
