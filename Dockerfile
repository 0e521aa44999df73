# The trainer as a container: a Vertex AI custom container, an AI Platform
# Training custom container (masterConfig.imageUri) and a Kubeflow TFJob
# image. `docker build -t REGISTRY/estimator-towers:0.1.0 .`
#
# Python 3.11: tf.estimator ends with TensorFlow 2.15, whose wheels stop at
# 3.11. For GPUs build FROM tensorflow/tensorflow:2.15.0-gpu instead: pip
# then keeps that image's TensorFlow (the package pins tensorflow==2.15.*).
FROM python:3.11-slim

WORKDIR /opt/estimator-towers
# Metadata first, so that code edits do not reinstall TensorFlow.
COPY setup.py setup.cfg pyproject.toml README.md ./
COPY estimator_towers/ estimator_towers/
COPY trainer/ trainer/
COPY model_fns/ model_fns/
COPY input_fns/ input_fns/
RUN python -m pip install --no-cache-dir . && \
    python -c "import trainer, input_fns, model_fns, estimator_towers"

# Run from elsewhere so that the installed package, not the sources, runs.
WORKDIR /
ENTRYPOINT ["python", "-m", "trainer.task"]
