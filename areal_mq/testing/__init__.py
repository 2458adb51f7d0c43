"""The test kit: the doubles and guards our own tests use, shipped so a workflow, reward or engine author tests
their code the way we test ours (STYLE 16)."""
