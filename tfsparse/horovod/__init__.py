"""Horovod's API on tfsparse, for scripts written for Horovod.

Horovod has had no release since 0.28.1 (2023), and on TensorFlow >= 2.16 with Keras 3 its
optimizer, tape and Keras callbacks fail.  A Horovod script runs on tfsparse after replacing
``horovod.`` with ``tfsparse.horovod.`` in its imports::

    import tfsparse.horovod.tensorflow as hvd          # was: import horovod.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum)

:mod:`tfsparse.horovod.tensorflow` and :mod:`tfsparse.horovod.tensorflow.keras` (with its
``callbacks``) hold the names of ``horovod.tensorflow`` and ``horovod.tensorflow.keras`` that
tfsparse provides, with Horovod's meaning; a name they do not provide raises an
``AttributeError`` that names it and lists what is provided.  Launch with ``tfsparse-run``, ``mpirun`` or
``horovodrun``.
"""
