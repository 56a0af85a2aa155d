"""TensorFlow's data service run by a hora job (Horovod's ``horovod.tensorflow.data``).

``python -m hora.tensorflow.data.compute_worker CONFIG`` under ``horarun`` starts a compute
job: tf.data dispatchers and workers, and the compute service that a training job meets
them through; a training job reads the config and calls ``dataset.send_to_data_service(...)``
(``hora.tensorflow.data.compute_service``). docs/tensorflow.md, "TensorFlow's data service".
"""
