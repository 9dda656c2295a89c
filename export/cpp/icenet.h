// IceNet: SOCA's sea-ice network as SOCA's MLBalance runs it (JCSDA soca MLBalance/MLJac.h includes IceNet.h; the
// class as published in guillaumevernieres/daml src/daml/IceEmul/IceNet.h), transcribed here without oops' logger:
// the same module and buffer names (fc1, fc2, input_mean, input_std), the same float32 buffers (torch::full of a
// double fill, which takes the default dtype, float32), the same forward (the input normalised by the buffers,
// fc1, fc2, sigmoid: nothing between fc1 and fc2), jac (the point wrapped with torch::from_blob as a float32 leaf
// that requires grad, one backward of the single output), initNorm, saveNorm (without its print of the mean),
// loadNorm and initWeights. SOCA's BaseEmul.h loads a trained one as
//
//   model_ = std::make_shared<IceNet>(inputSize_, hiddenSize_, outputSize_, kernelSize_, stride_);
//   model_->initWeights();
//   torch::load(model_, modelFileName);   // fc1.weight, fc1.bias, fc2.weight, fc2.bias, input_mean, input_std
//   model_->loadNorm(modelFileName);      // <dir>/normalization.<file>: {input mean, input std}
//
// and soca_icenet.cpp does the same. python -m toolkit.export torchscript RUN_DIR --out DIR/MODEL.pt --format soca
// writes the two files (toolkit/export/soca.py).
#pragma once

#include <torch/serialize.h>
#include <torch/torch.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct IceNet : torch::nn::Module {
  IceNet(int inputSize, int hiddenSize, int outputSize, int /*kernelSize*/ = 1, int /*stride*/ = 1) {
    // Define the layers.
    fc1 = register_module("fc1", torch::nn::Linear(inputSize, hiddenSize));
    fc2 = register_module("fc2", torch::nn::Linear(hiddenSize, outputSize));

    // Register mean and std as buffers
    inputMean = register_buffer("input_mean", torch::full({inputSize}, 0.0));
    inputStd = register_buffer("input_std", torch::full({inputSize}, 1.0));
  }

  // Initialize normalization
  void initNorm(torch::Tensor mean, torch::Tensor std) {
    inputMean = mean;
    inputStd = std;
  }

  void saveNorm(const std::string modelFileName) {
    // construct normalization file name
    std::filesystem::path filePath(modelFileName);
    auto path = filePath.parent_path();
    auto fileName = filePath.filename();

    // Save 1st and 2nd moments
    std::vector<torch::Tensor> moments = {this->inputMean, this->inputStd};
    torch::save(moments, path.string() + "/normalization." + fileName.string());
  }

  void loadNorm(const std::string modelFileName) {
    // construct normalization file name
    std::filesystem::path filePath(modelFileName);
    auto path = filePath.parent_path();
    auto fileName = filePath.filename();

    // Load 1st and 2nd moments
    std::vector<torch::Tensor> moments;
    torch::load(moments, path.string() + "/normalization." + fileName.string());
    this->inputMean = moments[0];
    this->inputStd = moments[1];
  }

  void initWeights() {
    // Xavier initialization for the first two layers
    torch::nn::init::xavier_normal_(fc1->weight);
    torch::nn::init::xavier_normal_(fc2->weight);
  }

  // Implement the forward pass
  torch::Tensor forward(torch::Tensor x) {
    // Normalize the input
    x = (x - inputMean) / inputStd;
    x = fc1(x);
    x = torch::sigmoid(fc2(x));
    return x;
  }

  // Compute the Jacobian (dout/dx)
  torch::Tensor jac(torch::Tensor x) {
    auto xp = torch::from_blob(x.data_ptr(), {x.size(0)}, torch::requires_grad());
    auto y = this->forward(xp);
    y.backward();
    return xp.grad();
  }

  // Define the layers.
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
  torch::Tensor inputMean;
  torch::Tensor inputStd;
};
