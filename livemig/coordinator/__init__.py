"""livemig.coordinator"""
