"""livemig.sandbox"""
