"""What leaves a run: the model as a Hugging Face directory (``hf_model``) and the training
step as a ``torch.export`` program (``training_step``)."""
