"""Merging specs: phase 5 of the tower build (see replicate.py).

The towers' EstimatorSpecs as one (spec_merge), EVAL's adds once per step
(metric_adds), TPUEstimatorSpecs (tpu_spec), predictions the graph walk
cannot prove checked against one device on the first batch
(prediction_audit); and SavedModels over towers:
batch prediction (saved_model_towers) and a SavedModelEstimator's model_fn
(saved_model_estimator).
"""
