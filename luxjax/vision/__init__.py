"""Model-agnostic image input pipeline: data URLs -> decoded RGB images -> chat parts, spans and chunk plans.

Nothing here names a model; a model backend supplies an ImagePreprocessor (see preprocess.py).
"""
