"""Training: the shared loop (trainer.py), data order (data.py), QAD of the W4 target (qad.py), regen."""
