"""Tools over whole checkpoints, for the ``ckptfs`` command and the package root.

- ``verify``: check a checkpoint end to end and report every problem (``ckptfs.verify``).
- ``convert``: any readable checkpoint to any writable backend, streaming (``ckptfs.convert``).
- ``unshard``: whole tensors into safetensors, ``torch.save`` or Hugging Face files (``ckptfs.unshard``),
  spread over every rank in a process group.
- ``hf_export``: Hugging Face files from a running job's sharded state (``ckptfs.export_hf``).
- ``hf_fp8``, ``hf_mxfp4``: FP8 block-quantized and MXFP4 Hugging Face weights dequantised on
  read (``ckptfs.load_hf_quantized``, also ``load_hf_fp8``).
- ``export_dir``: an export's destination, a local directory or an object-store prefix.
- ``torch_save``: a checkpoint to one ``torch.save`` file and back (``ckptfs.to_torch_save``,
  ``ckptfs.from_torch_save``: DCP's ``dcp_to_torch_save`` / ``torch_save_to_dcp``).
- ``describe``: what ``ckptfs inspect`` prints (index only).
- ``model_state``: ``save_model_and_optim_state`` / ``load_model_and_optim_state``.
- ``source``: open a checkpoint, select keys, stream tensors in bounded batches.
- ``safetensors_file``, ``torch_file``: single files written a tensor at a time.

Memory stays near the largest single tensor plus ``buffer_bytes``: tensors are read a bounded
batch at a time through the read engine and written out before the next batch is read.
"""
