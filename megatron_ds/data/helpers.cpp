// Index builders for the GPT and blended datasets: the two loops that are too slow in Python for
// billions of tokens. index_helpers.py holds the NumPy reference each function must match exactly.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

// Row i of `sample_index` is (position in document_index, token offset) where sample i starts. Sample i
// covers seq_length + 1 tokens of the concatenated stream, so sample i + 1 starts on the last token of
// sample i. Row 0 is (0, 0); the rows after it step seq_length tokens each.
template <typename Index>
void fill_sample_index(const py::array_t<int32_t> &sequence_lengths,
                       const py::array_t<int64_t> &document_index, int64_t seq_length,
                       py::array_t<Index, py::array::c_style> &sample_index) {
  auto lengths = sequence_lengths.unchecked<1>();
  auto documents = document_index.unchecked<1>();
  auto rows = sample_index.template mutable_unchecked<2>();
  const int64_t num_rows = rows.shape(0);
  const int64_t num_documents = documents.shape(0);
  if (num_rows == 0) return;
  py::gil_scoped_release release;

  int64_t position = 0;
  int64_t offset = 0;
  rows(0, 0) = 0;
  rows(0, 1) = 0;
  for (int64_t row = 1; row < num_rows; ++row) {
    int64_t needed = seq_length + 1;
    while (true) {
      if (position >= num_documents) {
        throw std::runtime_error("document index holds too few tokens for " +
                                 std::to_string(num_rows - 1) + " samples");
      }
      const int64_t available = lengths(documents(position)) - offset;
      if (available >= needed) {
        offset += needed - 1;  // the next sample starts on this sample's last token
        break;
      }
      needed -= available;
      ++position;
      offset = 0;
    }
    rows(row, 0) = static_cast<Index>(position);
    rows(row, 1) = static_cast<Index>(offset);
  }
}

// Megatron's greedy blend: sample i comes from the dataset whose count lags its share weight * i the
// most (the first such dataset on ties). Must stay bit-identical to the Python fallback, hence plain
// double arithmetic (built with -ffp-contract=off so no fused multiply-add changes a tie).
void fill_blending_indices(const py::array_t<double> &weights,
                           py::array_t<int16_t, py::array::c_style> &dataset_index,
                           py::array_t<int64_t, py::array::c_style> &dataset_sample_index) {
  auto share = weights.unchecked<1>();
  auto chosen = dataset_index.mutable_unchecked<1>();
  auto within = dataset_sample_index.mutable_unchecked<1>();
  const int64_t num_datasets = share.shape(0);
  const int64_t size = chosen.shape(0);
  std::vector<int64_t> counts(num_datasets, 0);
  py::gil_scoped_release release;

  for (int64_t i = 0; i < size; ++i) {
    const double progress = static_cast<double>(i > 1 ? i : 1);
    int64_t best = 0;
    double best_lag = share(0) * progress - static_cast<double>(counts[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double lag = share(d) * progress - static_cast<double>(counts[d]);
      if (lag > best_lag) {
        best_lag = lag;
        best = d;
      }
    }
    chosen(i) = static_cast<int16_t>(best);
    within(i) = counts[best];
    ++counts[best];
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ds dataset index builders";
  // Outputs are written in place: noconvert() refuses a wrong dtype instead of filling a silent copy.
  m.def("fill_sample_index_int32", &fill_sample_index<int32_t>, py::arg("sequence_lengths"),
        py::arg("document_index"), py::arg("seq_length"), py::arg("sample_index").noconvert());
  m.def("fill_sample_index_int64", &fill_sample_index<int64_t>, py::arg("sequence_lengths"),
        py::arg("document_index"), py::arg("seq_length"), py::arg("sample_index").noconvert());
  m.def("fill_blending_indices", &fill_blending_indices, py::arg("weights"),
        py::arg("dataset_index").noconvert(), py::arg("dataset_sample_index").noconvert());
}
