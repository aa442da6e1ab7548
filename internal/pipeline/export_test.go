package pipeline

// KeepPlansFor is keepPlansFor, for the tests.
var KeepPlansFor = keepPlansFor
