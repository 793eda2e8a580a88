"""The model organism: a tiny DeepSeek-V4 trained on needlescope's own retrieval chats.

Needs the ``[model]`` extra. ``bundle`` finds and loads checkpoints (shipped or local),
``tokenizer`` builds the word-level tokenizer and chat template, ``config`` the model shape,
``data`` the training corpus and ``train`` the recipe.
"""
