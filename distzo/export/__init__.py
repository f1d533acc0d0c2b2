"""What leaves a run: the model as a Hugging Face directory (``hf_model``), the training
step as a ``torch.export`` program (``training_step``), and a command's ``--out`` folder,
written whole or not at all (``out_dir``)."""
