"""The model organism: a tiny DeepSeek-V4 trained on needlescope's own retrieval chats.

Needs the ``[model]`` extra. ``tokenizer`` builds the word-level tokenizer and chat template,
``config`` the model shape, ``data`` the training corpus, ``train`` one training stage and
``recipe`` the shipped two-stage recipe; ``weights/`` holds the shipped checkpoint. Loading a
checkpoint (this one or any DeepSeek-V4) is ``needlescope.dsa.checkpoint``'s job.
"""
