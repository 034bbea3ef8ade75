"""Structured output: a request's spec (`StructuredOutputs`, plain data), the matchers that follow
it (`grammar.GrammarCompiler`, llguidance) and the step's token masks (`masks.MaskFiller`)."""

from radixkv.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
