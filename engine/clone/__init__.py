"""Voice cloning with Base models: reference audio -> a voice prompt -> talker prompts."""
